"""``sp.load`` (new tensors) and ``sp.load_into`` (the user's objects, in place).

``new`` loads a checkpoint as a new state; ``into`` opens it (on every rank of a group)
and runs ``planner``, which walks the target beside the saved tree and plans every read
into a :class:`~shardpoint._read.ReadBatch` before a byte of the target changes;
``result`` is what ``load_into`` reports; ``memory`` allocates and refuses loads the
machine cannot hold; ``settings`` resolves the per-call read settings; ``pickled`` reads
``.bin`` / ``.pt`` weights a batch at a time.
"""
