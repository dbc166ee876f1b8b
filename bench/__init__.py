"""zserve benchmarks: checkpoint builder and throughput comparison (not tests)."""
