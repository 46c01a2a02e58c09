"""moto's server for idem's tests, one request at a time.

DynamoDB applies each conditional write atomically; moto's own `moto_server` serves
requests on threads that can interleave a condition's check with another write. Served
one at a time, each request is atomic, as DynamoDB's are. Usage: moto_server.py PORT
"""
import sys

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
from werkzeug.serving import run_simple

run_simple(
    "127.0.0.1",
    int(sys.argv[1]),
    DomainDispatcherApplication(create_backend_app),
    threaded=False,
)
