"""A plugin module that fails at import time, like one with a missing dependency."""

raise ImportError("sg_routing_fixture.broken needs the 'frobnicate' package")
