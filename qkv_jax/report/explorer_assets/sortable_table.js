// Sortable tables: clicking a header cell (or Enter on it) sorts the body rows by that column,
// ascending first, then toggling. A cell sorts by its data-value attribute when it has one,
// else by its text; numbers compare as numbers, and empty values sort last either way.
"use strict";

function sortKey(cell) {
  const raw = cell === undefined ? "" : (cell.dataset.value ?? cell.textContent).trim();
  if (raw === "") return null;
  const number = Number(raw);
  return Number.isNaN(number) ? raw : number;
}

function compareKeys(a, b) {
  if (typeof a === "number" && typeof b === "number") return a - b;
  if (typeof a === "number") return -1; // numbers before text
  if (typeof b === "number") return 1;
  return String(a).localeCompare(String(b));
}

function sortTable(table, column, direction) {
  const body = table.tBodies[0];
  const sign = direction === "ascending" ? 1 : -1;
  const rows = Array.from(body.rows);
  rows.sort((rowA, rowB) => {
    const a = sortKey(rowA.cells[column]);
    const b = sortKey(rowB.cells[column]);
    if (a === null || b === null) return (a === null) - (b === null); // empty last
    return sign * compareKeys(a, b);
  });
  rows.forEach((row) => body.appendChild(row)); // appendChild moves the row: re-ordered in place
  Array.from(table.tHead.rows[0].cells).forEach((th, index) => {
    if (index === column) th.setAttribute("aria-sort", direction);
    else th.removeAttribute("aria-sort");
  });
}

function makeSortable(table) {
  Array.from(table.tHead.rows[0].cells).forEach((th, column) => {
    th.tabIndex = 0;
    const toggle = () =>
      sortTable(table, column, th.getAttribute("aria-sort") === "ascending" ? "descending" : "ascending");
    th.addEventListener("click", toggle);
    th.addEventListener("keydown", (event) => {
      if (event.key === "Enter") toggle();
    });
  });
}
