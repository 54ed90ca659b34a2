"""Alembic environment: runs on the connection the controller hands over (see Database.migrate)."""

from alembic import context

from vbs.controller.db.tables import Base

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
