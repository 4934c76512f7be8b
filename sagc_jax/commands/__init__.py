"""The subcommands of ``sagc-jax``, one module each (``replay`` beside ``simulate``): a module's
``add_parser`` defines its flags next to the function that runs it. ``sagc_jax.cli`` puts them
together; ``common`` holds what several share (``--config``/``--set``, the run directory, the
user-error type)."""
