"""The ``pdkv`` command line.  The serving code lives in the top-level folders (engine/, kvstore/, ...)."""
