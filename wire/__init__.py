"""The contract between zserve's processes: message types, their codec, socket addresses.

Nothing outside this package defines a type that crosses a socket. See DESIGN.md section 1.
"""

VERSION = "0.1.0"       # zserve's version: /server_info, and what nodes of one server agree on
