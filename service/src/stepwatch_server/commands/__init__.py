"""Commands: evidence the collector asks of a run's ranks, carried out by their agents (no inbound port).

store.py: the rows; pending.py: which ranks still owe an answer, held in memory for ingest's answers;
stacks.py: every rank's stacks grouped; routes.py: the API.
"""
