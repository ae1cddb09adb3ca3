"""What Ebb writes for tests, benches and the demo: language models of every family
(`model_gen.py`: a tiny random-weight model, or a header of real shapes), projectors of every
family (`projector_gen.py`: random weights, or the colour projector whose closed-form weights name
a picture's colour), and the demo projector made once for the default model (`demo.py`)."""
