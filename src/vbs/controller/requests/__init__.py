"""The requests as the API offers them, named after their verbs: each checks the caller's input and the
current state, writes the rows and begins the workflow (vbs.controller.workflows) that carries it out."""
