"""The shared state: its interface and data types (``base``), the embedded backend, Redis/Valkey, fail-open, the quota ledger's arithmetic, and which backend (``open``)."""
