"""models: build a model from model._target_ on the meta device, materialize it; the built-in transformer.
May import config and plan (the planner's torch-free rules a model shares: the SwiGLU width); user
models import nothing of dtk."""
