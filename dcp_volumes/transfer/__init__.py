"""Moving bytes: the adaptive in-flight limit (:mod:`.adaptive`; part uploads are the
save's, :mod:`dcp_volumes.saving._upload`), ranged downloads (:mod:`.download`) and what a
loading rank fetches (:mod:`.readplan`)."""
