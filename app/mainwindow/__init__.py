"""The main window and what it starts: `MainWindow` builds the window and routes engine
events; its controllers own one job each (`sending.py`: a message to its reply;
`models.py`: what is loaded and loading it again; `tuning.py`, `serving.py`,
`standin_control.py`); `worker.py` is the one thread that owns llama.cpp."""
