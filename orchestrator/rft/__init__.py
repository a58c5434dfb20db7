"""An Agent RFT job that points at this deployment (docs/agent-rft.md): the job body
(``job.py``), its dataset rows (``dataset.py``), and a preflight of the deployed endpoints
before a job is paid for (``preflight.py``)."""
