"""The dialogs: Settings, Open model, Get models (the Hub), What if, Chat settings, About
and Tune. A dialog returns what was chosen; the main window's controllers act on it."""
