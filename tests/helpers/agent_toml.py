"""The smallest agent.toml the config tests build on (hospital_agent.config): an aggregator, a work folder and TLS
files (which the config only names; nothing reads them)."""

AGENT_TOML = '''
aggregator = "agg:7443"
work_dir = "work"
[tls]
cert = "a.crt"
key = "a.key"
ca = "ca.crt"
'''
