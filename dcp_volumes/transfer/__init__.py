"""Moving bytes: the adaptive in-flight limit (:mod:`.adaptive`; part uploads are the
save's, :mod:`dcp_volumes.saving._upload`), ranged downloads (:mod:`.download`) and torch's
stream transforms (:mod:`.transforms`). What a load does with the bytes is
:mod:`dcp_volumes.loading`."""
