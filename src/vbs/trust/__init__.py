"""Who may do what, and proof of it: the install's CA and certificates (pki, tls), access keys
(credentials), per-node tokens, probe tickets, fencing tokens, and the checks every service makes
before it serves (fail_closed, agent_security)."""
