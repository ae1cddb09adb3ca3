"""Tool calling, one room for the window and the endpoint: the formats a model calls functions
in (calls.py), MCP servers the user adds (servers.py: their file; host.py: the SDK's clients
on a thread of their own), and the loop of a turn that calls them (loop.py)."""
