"""gRPC server reflection under both names tools ask for: ``grpc.reflection.v1`` and ``v1alpha``.

grpcio-reflection ships only the ``v1alpha`` service.  The ``v1`` service has the same messages with the
same field numbers (only the package differs), so the v1 method is served by the same servicer with the
same (de)serializers: the bytes on the wire are identical.  A tool that speaks only v1 (newer grpcurl,
Postman, grpcui) no longer gets UNIMPLEMENTED.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"


def enable_reflection(service_names: Sequence[str], server: grpc.Server) -> None:
    """Reflection for ``service_names`` (plus both reflection services) on ``server``."""
    names = (*service_names, reflection.SERVICE_NAME, V1_SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    servicer = reflection.ReflectionServicer(names)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {"ServerReflectionInfo": handler}),)
    )
