"""Tensor sources: a checkpoint of any format read one batch of tensors at a time.

``convert``, ``diff``, ``inspect`` and the checks of ``torch.save`` files read through them.
``contract`` holds the :class:`~shardpoint._sources.contract.TensorSource` contract (meta
descriptors first, tensors on request) and its helpers; ``pickled`` the ``torch.save`` /
HF ``.bin`` sources; ``open`` the safetensors and DCP sources and ``open_source``, which
opens any path as the right one.
"""
