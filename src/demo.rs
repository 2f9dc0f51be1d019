//! Embedded legacy MCP demo upstream (placeholder, being written).
