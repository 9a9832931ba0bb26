"""accumopt inside the frameworks people train with: thin, optional adapters (``lightning``,
``hf_trainer``, ``accelerate``). Each imports its framework only when imported itself; none is a
dependency of accumopt (``pip install "accumopt[lightning]"``, ``[transformers]``,
``[accelerate]``)."""
