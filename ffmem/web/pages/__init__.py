"""One module per page: its context models (what the template, the htmx fragment and the JSON twin all
render, each field described for /docs) beside the function that builds it from a session and the lookups
the route resolved (ffmem/web/deps.py). A builder raises AppError for anything asked that does not exist.
Views several pages share are in ffmem/web/views.py.
"""
