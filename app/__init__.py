"""Ebb's desktop window (PySide6). A view of engine events plus user commands."""
