"""Admission's gRPC front door: the public GatewayService and AdminService."""
