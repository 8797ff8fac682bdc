"""The HTTP routes, one router per concern; `deepwell.serve.api.create_app` assembles them.

Routes take the parts they use (routes/parts.py), API keys, bodies and admission slots
(routes/access.py) as dependencies.
"""
