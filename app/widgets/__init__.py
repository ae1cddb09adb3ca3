"""The window's parts: the transcript, the composer, the memory panel, the chat list, the
vision bar, notices and the picture viewer. Each is told what to show; none starts
engine work."""
