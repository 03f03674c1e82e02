"""The database: tables, keyword-only queries, the job queue, provisional results and export. No torch."""
