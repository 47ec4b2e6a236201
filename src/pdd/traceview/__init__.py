"""The trace viewer (`pdd trace`): a request's handoff timeline from its spans, as HTML and PNG."""
