"""The ``shardpoint`` command line: ``inspect``, ``verify`` (and more, registered in ``main``)."""
