"""Sending: a message to its reply. Send (with the checks that keep the composer's text when
it cannot go), edit, regenerate, continue, a message's versions and branches, the reply
streamed into the transcript, a reply the engine could not write given back to the composer,
and a reply a full disk kept tried again until it is saved."""
from __future__ import annotations

import re
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from PySide6.QtCore import QTimer
from PySide6.QtGui import QGuiApplication

from app.core.chat_state import ChatHistory, Pending, chat_tag, oversized, users_names
from app.core.settings import (
    DEMO_GREEDY_NOTE,
    chat_gen_params,
    chat_params,
    demo_chat_params,
    reply_seed,
)
from app.core.status import phases_line, restored_line
from app.core.store import Message
from engine import events
from engine.media.attachments import split as split_ref
from engine.media.kinds import CLIP, PDF, PICTURE, VIDEO, kind_of
from engine.errors import EbbError
from engine.llama.sampling import GenParams
from app.mainwindow.parts import WindowParts

# the streamed reply reaches the view 10 times a second: each update lays out the whole
# paragraph it grows (Qt shapes and breaks a block's text anew at every insert: 0.3 ms for a
# paragraph of 300 characters here) and repaints it, and on 2 cores every GUI cycle is taken
# from llama.cpp's threads (#54: 15 a second cost the GUI thread a fifth more than 10; a few
# tokens a step reads as smoothly)
REDRAW_MS = 100
RATE_EVERY_S = 1.0  # the status line's live tokens/s, this often
RETRY_SAVE_MS = 3000  # how often a reply a full disk kept is offered to the store again
UNDO_S = 60  # an Undo notice stays this long (the trash keeps what went for days)
PERSIST_IDLE_MS = 20_000  # this long after a reply with nothing else: the chat's memory to disk


TOOL_COMMAND = re.compile(r"^/tool\s+(\S+)\s*", re.S)


def tool_command(text: str) -> tuple[str, str]:
    """A message that begins "/tool NAME": (the rest, NAME: the tool the model must call
    first); else (text, "")."""
    m = TOOL_COMMAND.match(text)
    return (text[m.end():], m.group(1)) if m else (text, "")


class Sending:
    def __init__(self, window: WindowParts) -> None:
        self.w = window
        self._copy_names: dict[str, str] = {}  # the store's copy → the user's file, per request
        self._last_history: ChatHistory | None = None  # the engine's, while it takes it up
        self._rate_shown_at = 0.0  # when the status line last said the live tokens/s
        # a reply a full disk kept from the store: tried again until it is written
        self._retry_saving = QTimer(window.window(), interval=RETRY_SAVE_MS)
        self._retry_saving.timeout.connect(self._on_retry_saving)
        self.redraw = QTimer(window.window(), interval=REDRAW_MS)  # the stream into the transcript
        self.redraw.timeout.connect(self.take_stream)
        self._persist_when_idle = QTimer(window.window(), interval=PERSIST_IDLE_MS, singleShot=True)
        self._persist_when_idle.timeout.connect(self._on_idle)

    def handlers(self) -> dict[type, Callable[[Any], None]]:
        return {events.TurnFinished: self.on_turn_finished,
                events.PrefillProgress: self.on_prefill_progress}

    def on_prefill_progress(self, ev: events.PrefillProgress) -> None:
        """A long prompt shows how far it got (the Steps lane draws it too)."""
        if ev.n_total:
            self.w.statusBar().showMessage(
                f"Reading the prompt: {ev.n_done:,} of {ev.n_total:,} tokens "
                f"({100 * ev.n_done // ev.n_total}%) · Stop ends it", 5000)

    def send(self) -> None:
        """Send what the composer holds (Enter, the Send button)."""
        text, images = self.w.composer.text(), list(self.w.composer.attachments)
        if (not text and not images) or not self.w.chat.can_send():
            return
        gone = [p for p in images if not split_ref(p)[0].is_file()]
        if gone:  # deleted or moved since attached: taken off, the rest kept, said by name
            for p in gone:
                self.w.composer.detach(p)
            self.w.composer.show_error(
                f"{', '.join(Path(p).name for p in gone)} "
                f"{'is' if len(gone) == 1 else 'are'} gone (deleted or moved since attached) and "
                "taken off; your text and the other attachments are kept. Send again to send "
                "without it, or attach it again.")
            return
        if any(kind_of(split_ref(p)[0]) in (PICTURE, CLIP, VIDEO) for p in images) and not self.w.vision.on:
            self.w.composer.show_error(f"Turn {self.w.vision.switch.text().lower()} on to send pictures "
                                       "or clips (no reload needed).")
            return
        if self.w.composer.over_budget:  # Enter, with Send off: the budget line says why
            self.w.composer.show_error(self.w.composer.budget.text())
            return
        too_big = oversized(text, self.w.models.n_ctx)
        if too_big:  # refused from its size at once: not stored, not titled, not tokenized
            self.w.composer.show_error(too_big)
            return
        if tool_command(text)[1] and self.w.tools.for_send(self.w.conv_id, tell=False) is None:
            # asked for a tool and none can be called: kept in the composer, not sent without
            self.w.composer.show_error(
                f"“/tool {tool_command(text)[1]}” needs a tool server that is ready in this chat: "
                "Model → Tools… switches one on, shows why one failed and restarts it. Your "
                "message is kept.")
            return
        if self.w.composer.editing is not None:
            try:
                self._send_edit(self.w.composer.editing, text, images)
            except EbbError as exc:  # not saved (a full disk): the composer keeps it all
                self.w.composer.show_error(str(exc))
            return
        try:
            self._greedy_for_the_demo(images)  # before the message: a failed write saves neither
            pending = self.w.chat.add_user_message(text, images)
        except EbbError as exc:  # not saved (a full disk): the composer keeps it all
            self.w.composer.show_error(str(exc))
            return
        finally:
            self.w.composer.adopt_chat(self.w.conv_id)  # a new chat has its id from now
        self.w.composer.clear()
        saved = self.w.store.message(pending.message_id)
        if saved is not None:
            self.w.transcript.append_message(saved, scroll=True)
        titled = self.w.store.n_messages(self.w.conv_id) == 1  # the chat is named by this message
        # the composer gets back what the user gave, the engine the stored copies
        self._dispatch(Pending(text, images, pending.message_id), pending.images)
        if titled:  # the list shows the new title
            self.w.chats.refresh()

    def _greedy_for_the_demo(self, images: list[Path]) -> None:
        """A picture for the demo projector, in a chat with no sampling of its own: the chat
        replies greedily from now on (its own setting, said once), so the demo names the
        colour every time (app/core/settings.py, DEMO_GREEDY_NOTE)."""
        d = self.w.models.loaded
        seen = [p for p in images if kind_of(split_ref(p)[0]) in (PICTURE, VIDEO, PDF)]  # not a clip
        if (seen and d is not None and d.projector_names_colours
                and demo_chat_params(self.w.store, self.w.conv_id)):
            self.w.notices.say(DEMO_GREEDY_NOTE, "info")

    def _dispatch(self, pending: Pending, images: list[Path], history_before: int = 0) -> None:
        """Ask the engine for the reply. `history_before`: a new version of that message (an
        edit, a regeneration): the engine's history is first set to the messages ahead of it
        (its KV cache is kept up to where they differ)."""
        # the engine reads the store's copies; an error about one names the user's file
        self._copy_names = {split_ref(c)[0].name: split_ref(u)[0].name for c, u in zip(images, pending.images)}
        if history_before:
            self.send_history(before=history_before)
        gp = self.chat_gen_params()
        seed, fixed = reply_seed(gp.seed, gp.temperature)  # each version its own, unless fixed
        if seed is not None:
            gp = replace(gp, seed=seed)
        pending = replace(pending, seed=seed, seed_fixed=fixed)
        request_id = self.w.chat.begin(pending)
        self.w.panel.set_live(True)  # the plots follow the reply to now
        self.w.welcome.hide()
        self.w.worker.stream.take()  # nothing left over from an earlier request
        self.w.transcript.begin_reply(pending.continues, scroll=True)
        if pending.continues is not None:
            self.w.request_continue.emit(request_id, gp)
        else:
            # the chat's tools, read by the worker as the turn begins (the queued send after it);
            # "/tool NAME …" asks the model to call that tool first (the message goes without it)
            text, choice = tool_command(pending.text)
            tools = self.w.tools.for_send(self.w.conv_id)
            self.w.worker.turn_tools = (*tools, choice) if tools is not None else None
            self.w.request_send.emit(request_id, text if tools is not None else pending.text,
                                     [str(p) for p in images], gp)
        self.w.update_actions()

    def _send_edit(self, target: Message, text: str, images: list[Path]) -> None:
        """Send while editing: a new version of the message (answered, for the user's own)."""
        if target.role == "assistant":
            if not text:
                return
            self.w.chat.edit_reply(target.id, text)
            self.w.composer.clear()
            self.send_history()
            self.w.show_conversation()
            return
        pending = self.w.chat.edit(target.id, text, images)
        if pending is None:
            return
        self.w.composer.clear()
        self.w.show_conversation()
        self._dispatch(replace(pending, text=text, images=images), pending.images,
                       history_before=pending.message_id)

    def regenerate(self, reply_id: int = 0) -> None:
        """Another version of a reply (the old one stays, ‹ › between them)."""
        pending = self.w.chat.regenerate(reply_id)
        if pending is None:
            return
        self.w.show_conversation()
        self._dispatch(pending, pending.images, history_before=pending.message_id)

    def on_regenerate(self) -> None:
        self.regenerate()

    def continue_last(self) -> None:
        """Go on with the last reply where it stopped (its cap, or Stop)."""
        pending = self.w.chat.continue_last()
        if pending is not None:
            self._dispatch(pending, [])

    def on_message_action(self, kind: str, message_id: int) -> None:
        """A message's link: Edit, Regenerate, Delete, or its previous or next version; the
        system prompt's "change" (kind "system")."""
        if kind == "system":
            self.w.edit_chat_settings()
            return
        if self.w.chat.busy:
            self.w.statusBar().showMessage("A reply is being written: wait for it, or Stop it", 8000)
            return
        m = self.w.store.message(message_id)
        if m is None:
            return
        try:
            if kind in ("prev", "next"):
                i = m.siblings.index(m.id) + (1 if kind == "next" else -1) if m.id in m.siblings else -1
                if self.w.chat.switch_version(m.id, 1 if kind == "next" else -1):
                    self.send_history()
                    self.w.show_conversation(m.siblings[i])
            elif kind == "edit":
                self.w.composer.start_edit(m)
            elif kind == "regen":
                self.regenerate(m.id)
            elif kind == "delete":
                self._delete_branch(m)
        except EbbError as exc:  # a full disk
            self.w.notices.error(str(exc))

    def _delete_branch(self, m: Message) -> None:
        ids = self.w.chat.delete_branch(m.id)
        if not ids:
            return
        self.send_history()
        self.w.show_conversation()
        n = len(ids)
        self.w.notices.say(f"Deleted {n} message{'' if n == 1 else 's'} from this chat.", "info",
                           ("Undo", lambda: self._undo_delete_branch(ids)), timeout_s=UNDO_S)

    def _undo_delete_branch(self, ids: list[int]) -> None:
        try:
            if not self.w.chat.undo_delete_branch(ids):
                self.w.statusBar().showMessage("Open that chat, with no reply being written, to "
                                               "bring its messages back", 8000)
                return
        except EbbError as exc:
            self.w.notices.error(str(exc))
            return
        self.send_history()
        self.w.show_conversation(ids[0])

    def take_stream(self) -> None:
        """Timer: what the engine streamed since the last tick, into the transcript at once."""
        new = [text for rid, text in self.w.worker.stream.take() if rid == self.w.chat.request_id]
        if new:
            for t in new:
                self.w.chat.add_text(self.w.chat.request_id, t)
            self.w.transcript.stream("".join(new))
            now = time.monotonic()
            if now - self._rate_shown_at >= RATE_EVERY_S:  # not at every update: a repaint each
                n, rate = self.w.chat.live_rate()
                self._rate_shown_at = now
                self.w.statusBar().showMessage(f"Writing: {n} tokens" + (f" · {rate:.1f} tok/s" if rate else ""),
                                               2000)

    def on_turn_finished(self, ev: events.TurnFinished) -> None:
        res = ev.result
        self.w.panel.set_live(False)
        self.set_record_limit(res.gen.n_prompt_tokens + res.gen.n_gen_tokens)
        if res.device_lost:
            self.w.notices.say(f"{res.device_lost}: the conversation goes on with the devices "
                               "that are left.")
        self.take_stream()  # the last pieces, before the reply is shown as saved
        if self.w.statusBar().currentMessage().startswith("Writing:"):
            self.w.statusBar().clearMessage()  # it said "Writing" for up to 2 s after the end
        if res.phases is not None and res.error is None:
            self.w.statusBar().showMessage(phases_line(res.phases), 60000)
        if res.error is None and (said := restored_line(res.gen)):
            self.w.statusBar().showMessage(said, 60000)
        self._persist_when_idle.start()  # the chat's memory to disk, once nothing happens
        pending = self.w.chat.pending
        taken = [split_ref(r)[1] for r in res.attachments]
        retell = res.error is None and any(taken) and pending is not None and pending.continues is None
        if retell and pending is not None:
            try:  # the frames and pages the engine took: a reopened chat puts back the same
                self.w.store.set_fragments(pending.message_id, taken)
            except EbbError:
                retell = False  # kept as attached: reopened, it is chosen again the same way
        for note in res.notes:  # named as the user's file, not the store's copy
            self.w.notices.say(users_names(note, self._copy_names), "info")
        cfg = self.w.chat.last_cfg  # which model wrote it (an export says)
        failed = self.w.chat.finish(res, Path(str(cfg.model_path)).name if cfg is not None else "")
        if self.w.chat.save_error:
            self.w.notices.error(f"Could not save the reply: {self.w.chat.save_error}. It is kept "
                              "here and written as soon as a write succeeds.")
            self._retry_saving.start()
        if failed is not None:
            self.give_back(failed, res.error or "")
        else:
            self.w.transcript.end_reply(self.w.chat.saved)
            saved = self.w.chat.saved
            if retell or (saved is not None and saved.stats.memory_from
                          not in (None, self.w.transcript.memory_from)):
                # the line "outside the model's memory" moves; a video says the frames it gave
                self.w.show_conversation()
        self.w.update_actions()

    def _on_retry_saving(self) -> None:
        if not self.w.chat.unsaved:
            self._retry_saving.stop()
            return
        if self.w.chat.busy or not self.w.chat.retry_unsaved():
            return
        if not self.w.chat.unsaved:
            self._retry_saving.stop()
            self.w.notices.area.remove_matching("Could not save the reply")
            self.w.statusBar().showMessage("The reply that could not be saved is saved now", 10000)
        self.w.show_conversation()

    def give_back(self, pending: Pending, error: str) -> None:
        """A message the engine could not answer: out of the engine's history, back in the
        composer (nothing the user wrote is lost), with the reason. A Continue that failed
        leaves the reply as it was."""
        error = users_names(error, self._copy_names)
        self.w.notices.last_error = error
        if pending.continues is not None:
            self.w.transcript.end_reply(pending.continues)
            self.w.notices.error(f"Could not continue: {error}")
            return
        self.send_history()  # the branch as it stands now (the message taken back)
        if pending.regenerates:  # the earlier versions of the reply stay
            self.w.show_conversation()
            self.w.notices.error(f"Could not regenerate the reply: {error}")
            return
        edited = self.w.store.message(pending.edits) if pending.edits else None
        if edited is not None:  # still an edit of that message
            self.w.composer.start_edit(edited, pending.text, pending.images)
        else:
            self.w.composer.restore(pending.text, pending.images)
        self.w.composer.show_error(error)
        self.w.show_conversation()
        self.w.chats.refresh()  # a chat this message had named is "New chat" again

    def send_history(self, before: int | None = None) -> None:
        """The open branch and the chat's system prompt, to the engine (with `before`, only
        the messages ahead of that one)."""
        system = chat_params(self.w.store, self.w.conv_id).system_prompt or None
        history = ChatHistory(self.w.chat.history(before), system, chat_tag(self.w.conv_id))
        if self._last_history is not None:  # its state need not be taken back any more
            self._last_history.superseded.set()
        self._last_history = history
        self.w.request_history.emit(history)

    def set_record_limit(self, used: int) -> None:
        """How long a recording may run: the 30-second chunks the context has room for after
        `used` cells and the reply's room (at least one chunk when one fits the context), less
        a second (a clip of exactly k x 30 s takes k + 1 chunks)."""
        from engine.conversation import reply_room
        from engine.media.audio import MAX_CLIP_SECONDS

        loaded = self.w.models.loaded
        room = self.w.models.n_ctx - reply_room(self.w.models.n_ctx)
        # a video's frames and a PDF's pages: what each takes, against what the context has
        # free (at least half of it: older turns leave for a long message)
        self.w.composer.picture_tokens = loaded.picture_tokens if loaded is not None and loaded.vision else 0
        self.w.composer.room_tokens = max(room - used, room // 2) if loaded is not None else 0
        per = loaded.clip_chunk_tokens if loaded is not None else 0
        self.w.composer.clip_chunk_tokens = max(per, 0)
        self.w.composer.recount()
        if per <= 0:
            self.w.composer.record_limit_s = 0
            return
        chunks = max((room - used) // per, 1 if room >= per else 0)  # older turns make room
        self.w.composer.record_limit_s = float(min(MAX_CLIP_SECONDS, 30 * chunks - 1) if chunks else 0)

    def chat_gen_params(self) -> GenParams:
        return chat_gen_params(self.w.store, self.w.conv_id, self.w.gen_params)

    def stop(self) -> None:
        if not self.w.chat.busy and self.w.composer.editing is not None:  # Esc leaves an edit
            self.w.composer.cancel_edit()
            return
        self.w.worker.cancel()

    def copy_reply(self) -> None:
        last = self.w.chat.last_message()
        if last is not None and last.role == "assistant":
            QGuiApplication.clipboard().setText(last.text)

    def _on_idle(self) -> None:
        if not self.w.chat.busy:
            self.w.request_persist.emit()
