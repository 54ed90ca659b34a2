"""The REST edge of the controller: /v1 routes, their pydantic schemas, the checks on a request's
head (edge), work handed on after the answer and completion without polling (?wait=N)."""
