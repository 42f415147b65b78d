"""Conformance suite, local servers and fault injection for dcp_volumes backends."""
