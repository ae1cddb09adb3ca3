"""What the window keeps about tools, without Qt: the servers' file (`mcp.json` in the data
folder, the format Claude Desktop and LM Studio write), the user's consent to each stdio
server's exact definition, and each chat's own switches (which servers it uses, which tools it
always allows). GUI thread (the store's)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from app.core.store import Store
from engine.tools.servers import ServerDef

SERVERS_FILE = "mcp.json"
CONSENT_KEY = "tools.consent"  # server name -> the fingerprint the user said yes to


def servers_path(store: Store) -> Path:
    return store.folder / SERVERS_FILE


def consented(store: Store, d: ServerDef) -> bool:
    """The user said yes to this server as it is now defined (a URL server runs nothing here:
    it needs no consent)."""
    if not d.stdio:
        return True
    seen = store.settings.get(CONSENT_KEY, {})
    return isinstance(seen, dict) and seen.get(d.name) == d.fingerprint()


def set_consent(store: Store, d: ServerDef, yes: bool) -> None:
    seen = store.settings.get(CONSENT_KEY, {})
    seen = dict(seen) if isinstance(seen, dict) else {}
    if yes:
        seen[d.name] = d.fingerprint()
    else:
        seen.pop(d.name, None)
    store.settings.set(CONSENT_KEY, seen)


@dataclass(frozen=True)
class ChatTools:
    """A chat's tools: the servers switched on for it, and the tools (server:tool) the user
    allowed for the whole chat ("Always for this tool in this chat")."""
    servers: tuple[str, ...] = ()
    always: frozenset[str] = field(default_factory=frozenset)


def chat_tools(store: Store, conv_id: int) -> ChatTools:
    own = store.settings.get(f"tools:{conv_id}", {}) if conv_id else {}
    if not isinstance(own, dict):
        return ChatTools()
    servers = own.get("servers", [])
    always = own.get("always", [])
    return ChatTools(tuple(str(s) for s in servers if isinstance(s, str)) if isinstance(servers, list) else (),
                     frozenset(str(a) for a in always if isinstance(a, str)) if isinstance(always, list)
                     else frozenset())


def set_chat_tools(store: Store, conv_id: int, tools: ChatTools) -> None:
    store.settings.set(f"tools:{conv_id}", {"servers": list(tools.servers), "always": sorted(tools.always)})
