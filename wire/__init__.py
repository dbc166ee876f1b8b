"""The contract between zserve's processes: message types, their codec, socket addresses.

Nothing outside this package defines a type that crosses a socket. See DESIGN.md section 1.
"""
