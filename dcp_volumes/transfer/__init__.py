"""Moving bytes: part uploads (:mod:`.upload`), the adaptive in-flight limit
(:mod:`.adaptive`), ranged downloads (:mod:`.download`) and what a loading rank fetches
(:mod:`.readplan`)."""
