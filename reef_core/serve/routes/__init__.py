"""The routes of the HTTP API and the dashboard, and what they share: reading bodies and names at the door,
relaying streams, noticing a client gone."""
