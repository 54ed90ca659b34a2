"""The controller: public REST API, metadata DB (the one source of truth) and workflows with rollback."""
