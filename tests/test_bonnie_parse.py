"""The reading of bonnie++'s CSV line (format 1.98, bonnie++ 2.00a) into the paper's (docs/architecture.md §1)
figures, and the
sizes bonnie++ accepts. The line is one Debian's bonnie++ printed on this machine
(``bonnie++ -q -d D -s 16:4k -r 8 -n 1 -u 0:0 -m test``)."""

from __future__ import annotations

import pytest

from vbs.errors import DriverError, InvalidParameter
from vbs.rigs.testguest.bonnie import PAPER_COLUMNS, BonnieSize, parse_csv

pytestmark = pytest.mark.unit

HOST_RUN = (
    "1.98,2.00a,test,1,1795691669,16M,,8192,5,666,29,+++++,+++,+++++,+++,1478,36,+++++,+++,15029,48,1,,,,,1127,1,"
    "+++++,+++,+++++,+++,+++++,+++,+++++,+++,+++++,+++,47652us,8013us,8028us,20887us,10691us,39736us,18287us,34us,"
    "8223us,18641us,10us,13439us"
)


def test_the_csv_line_is_found_among_the_human_readable_lines_and_read_by_column() -> None:
    result = parse_csv(f"Version 2.00a  ------Sequential Output------\n{HOST_RUN}\n")
    assert (result.label, result.file_size) == ("test", "16M")
    assert (result.putc_kib_s, result.getc_kib_s, result.seeks_per_s) == (666, 1478, 15029)
    assert result.seq_create_per_s == 1127


def test_plus_signs_mean_too_quick_to_time_and_read_as_none() -> None:
    result = parse_csv(HOST_RUN)
    assert result.put_block_kib_s is None and result.rewrite_kib_s is None and result.get_block_kib_s is None
    assert result.seq_delete_per_s is None and result.random_create_per_s is None


def test_a_rate_with_a_unit_is_converted_to_kib_per_second() -> None:
    cols = HOST_RUN.split(",")
    cols[11] = "12M"
    assert parse_csv(",".join(cols)).put_block_kib_s == 12 * 1024


def test_every_paper_column_is_a_figure_of_the_result() -> None:
    result = parse_csv(HOST_RUN)
    assert [getattr(result, name) for _, name in PAPER_COLUMNS] == [
        666, None, None, 1478, None, 1127, None, None, None
    ]


@pytest.mark.parametrize("output", ["", "bonnie++: cannot open file", HOST_RUN.rsplit(",", 20)[0]])
def test_output_without_a_whole_csv_line_is_refused(output: str) -> None:
    with pytest.raises(DriverError):
        parse_csv(output)


def test_a_file_smaller_than_twice_the_ram_is_refused_as_bonnie_would() -> None:
    with pytest.raises(InvalidParameter):
        BonnieSize(file_mib=16, ram_mib=9, files_k=1)
    assert BonnieSize(file_mib=16, ram_mib=8, files_k=1).file_mib == 16
