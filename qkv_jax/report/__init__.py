"""Reading a finished run or sweep: report.json, pictures and report.html, the attention explorer."""
