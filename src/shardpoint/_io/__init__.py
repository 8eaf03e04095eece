"""Moving tensor bytes: one read engine (:mod:`.reads`) and one write engine (:mod:`.writes`).

Each runs its work on the one runner (:mod:`.threads`), over local files (:mod:`.files`) or
an object store (the store passed in), with crc32c on the same pass; :mod:`.plan` cuts the
work, :mod:`.staging` holds the readers' staging buffers, :mod:`.memory` views tensor bytes.
"""
