"""The REST API's request and response models (pydantic), apart from the DB tables: one module per resource
(``volumes``, ``snapshots``, ``nodes``, ``operations``…) and what they share (``common``).

Requests are strict: unknown fields, wrong JSON types and out-of-range values are refused at the
edge with ``InvalidParameterValue`` before anything reaches the domain or a driver.
"""
