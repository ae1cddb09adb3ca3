"""The window's Qt-free part: chats and their versions (`chat_state.py`), the SQLite store,
settings, exports, the words the window says, the stand-in's plan. Tested without a
display; an import-linter contract keeps Qt out."""
