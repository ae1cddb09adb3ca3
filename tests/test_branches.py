"""A conversation is a tree, in the real window over the real model: edit a message, regenerate,
move between versions, restart, search an old branch, delete a branch and undo."""
from __future__ import annotations

from PySide6.QtCore import QUrl

from app.core.store import Store
from tests.helpers import fresh_store, open_window, send, wait_for


def _click(w, kind: str, message_id: int) -> None:
    """A message's link in the transcript, as a click sends it."""
    w.transcript.anchorClicked.emit(QUrl(f"msg:{kind}/{message_id}"))


def _texts(store, cid):
    return [m.text for m in store.messages(cid)]


def test_edit_regenerate_switch_restart_search_and_undo(qtbot, tmp_path):
    store = fresh_store(tmp_path)
    w = open_window(qtbot, store, max_tokens=12)
    for q in ("Name a fruit.", "Tell me about zebras.", "Name a city."):
        send(qtbot, w, q)
    cid = w.conv_id
    u1, r1, u2, r2, u3, r3 = store.messages(cid)
    assert r3.stats.n_prompt_tokens_evaluated < r3.stats.n_prompt_tokens  # never left

    # edit the second question: a new version, answered; the old one stays
    _click(w, "edit", u2.id)
    assert w.composer.editing is not None and w.composer.edit.toPlainText() == u2.text
    assert w.composer.edit_bar.isVisibleTo(w)
    send(qtbot, w, "Tell me about giraffes.")
    branch = store.messages(cid)
    assert [m.text for m in branch[:3]] == [u1.text, r1.text, "Tell me about giraffes."]
    assert len(branch) == 4 and branch[2].siblings == (u2.id, branch[2].id)
    assert "‹ 2/2 ›" in w.transcript.toPlainText() and "zebras" not in w.transcript.toPlainText()
    # only what follows the common prefix was evaluated (the first exchange was kept)
    edited = branch[3].stats
    assert edited.n_prompt_tokens_evaluated <= edited.n_prompt_tokens - r1.stats.n_prompt_tokens

    # regenerate that reply twice: three versions of it
    for _ in range(2):
        _click(w, "regen", store.messages(cid)[-1].id)
        wait_for(lambda: not w.chat.busy)
    assert len(store.messages(cid)[-1].siblings) == 3 and "‹ 3/3 ›" in w.transcript.toPlainText()

    # back to the first version of the question: its whole branch comes back
    _click(w, "prev", store.messages(cid)[2].id)
    assert _texts(store, cid) == [m.text for m in (u1, r1, u2, r2, u3, r3)]
    assert "zebras" in w.transcript.toPlainText() and "‹ 1/2 ›" in w.transcript.toPlainText()
    # going on there takes back the branch's state and evaluates only the tokens after what it
    # shares (that the reply then equals one that never left is test_reopen's, compared on one
    # evaluation path: here the prompt's last token is evaluated alone, there in its batch)
    _click(w, "regen", r3.id)
    wait_for(lambda: not w.chat.busy)
    again = store.messages(cid)[-1]
    assert again.id != r3.id and again.text.strip() and again.siblings[-1] == again.id
    assert again.stats.n_prompt_tokens_restored > 0  # the branch's state, kept when it was left
    assert again.stats.n_prompt_tokens_evaluated <= (again.stats.n_prompt_tokens
                                                        - r1.stats.n_prompt_tokens)

    # a reply edited by the user is a version of it too (nothing generated)
    _click(w, "edit", r1.id)
    w.composer.edit.setPlainText("A pear.")
    w.sending.send()
    assert not w.chat.busy and _texts(store, cid) == [u1.text, "A pear."]
    assert store.messages(cid)[-1].siblings[0] == r1.id
    _click(w, "prev", store.messages(cid)[-1].id)
    assert _texts(store, cid)[:3] == [u1.text, r1.text, u2.text]
    # Ebb stops while a reply on another branch is being written
    half = store.add_message(cid, "assistant", "A city named", state="streaming", parent=u3.id)
    store.open_branch(again.id)
    w.close()

    # after a restart: the branch that was open, and a search finds a word that only an
    # older branch has, opens that branch and marks the word
    store.close()
    again_store = Store(tmp_path / "data")
    w = open_window(qtbot, again_store, max_tokens=12)
    assert "zebras" in w.transcript.toPlainText() and "giraffes" not in w.transcript.toPlainText()
    # Continue follows the open branch's last reply (its own stop), not the one interrupted on
    # another branch (a greedy reply may stop on its cap or end: drafted or not, it may differ
    # where the model's choice is close)
    from engine import stops

    assert w.continue_button.isVisibleTo(w) == stops.can_continue(again.stats.stop_reason)
    # that reply is marked, and Continue is offered when its branch is opened
    _click(w, "next", again.id)
    assert again_store.message(half).state == "interrupted"
    assert "interrupted" in w.transcript.toPlainText() and w.continue_button.isVisibleTo(w)
    w.chats.search.setText("giraffes")
    assert w.chats.list.count() == 1
    w.chats.open_item(w.chats.list.item(0))
    assert "giraffes" in w.transcript.toPlainText() and w.transcript.marked == ["giraffes"]
    edited_q = again_store.messages(cid)[2]

    # delete that version: the other one is open, alone; Undo brings it back
    _click(w, "delete", edited_q.id)
    assert again_store.messages(cid)[2].siblings == (u2.id,)
    assert "giraffes" not in w.transcript.toPlainText()
    undo = [n for n in w.notices.area.notices() if n.action_button is not None]
    assert undo and "Deleted 4 messages" in undo[-1].text()  # the question and its 3 replies
    undo[-1].action_button.click()
    assert again_store.messages(cid)[2].id == edited_q.id and "‹ 2/2 ›" in w.transcript.toPlainText()
    again_store.close()
