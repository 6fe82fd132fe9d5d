"""models: build a model from model._target_ on the meta device, materialize it; the built-in transformer.
May import config only; user models import nothing of dtk."""
