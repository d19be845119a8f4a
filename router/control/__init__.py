"""Configuration that changes while serving: the routing policies' and access documents' sync between routers, and the API keys."""
