"""What a user runs, apart from the library it drives: the ``kvtier`` command (cli.py: demo, bench, replay,
status, config, prefetch), ``kvtier status`` (status.py, over the daemons' answers: status_shape.py) and the trace
replay (replay/). Nothing of the library imports from here."""
