"""What wraps every route: authentication and tenancy, connection limits, rate limits and budgets, metrics and
the request log line."""
