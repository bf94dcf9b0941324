"""Identities and signatures: certificates and their identities (``tls``), the
revocation list (``revocation``), certificates reloaded while the node runs
(``tls_reload``) and signed grants, births, writes and ends (``signing``).
docs/security.md.
"""
