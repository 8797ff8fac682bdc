"""The HTTP routes, one router per concern; `deepwell.serve.api.create_app` assembles them.

Routes share a `ServeContext` and take API keys, bodies and admission slots as dependencies.
"""
