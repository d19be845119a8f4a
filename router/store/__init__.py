"""What is written durably: the decision log (SQLite, PostgreSQL), policy and access documents, migrations and events, the audit log, and the readers that pick a backend by URL."""
