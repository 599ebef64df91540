"""The LLM side: the providers behind one protocol, a recorded exchange made through outages, a reply read
and checked, the meter of cost, the strict prompt renderer, and the recorded LLM that answers a past
run's exchanges again.

Not here: what is asked (the roles, agent.roles), what is kept of an exchange (agent.ledger).
"""
