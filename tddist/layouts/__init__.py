"""Checkpoint layouts: how the ranks' bytes are stored (see ``base.ShardWriter``).

``directory``: a directory tree, one file per leaf and rank (tensordict's
memmap layout in each rank directory). ``archive``: one zip file for all
ranks, each writing its own region. Each module holds its layout's writer
and its reader of committed files.
"""
